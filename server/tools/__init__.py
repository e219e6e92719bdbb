"""Operator commands that are clients of a running server or read its config: `stoker check`,
`inspect`, `datasets`, `stats`, `autoscale`. Each is imported by the CLI on use.
"""
