"""stoker.integrations: stoker inside the training frameworks people already use.

One module a framework, each importing its framework only when imported itself, so that
`import stoker.integrations` costs nothing and the core install does not grow (extras
`lightning`, `hf`, `ray`). They are clients of the public `stoker.client` (and, for a fleet,
`stoker.server`'s `ServerProcess`); see docs/integrations.md.
"""
