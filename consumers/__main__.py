"""``python -m consumers``: the trainer role (see ``consumers.cli``)."""

from consumers.cli import main

if __name__ == "__main__":
    main()
