"""The stream worker's Faust half: the app, its agent, transactions, topics, tables, restores
and the broker's credentials; the decisions it applies live one level up, framework-free."""
