"""`ragcache demo` and the data it uses (Python docs corpus, FAQ and MMLU questions).

Not on the runtime path: nothing in the engine imports this package.
"""
