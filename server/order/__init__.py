"""Pure ordering math: coordinates -> sample indices, token budgets, mixtures, fingerprints.

Runs in the front end and in the workers alike; imports nothing of the server but the
storage listing's types, and no process, thread or socket is made here.
"""
