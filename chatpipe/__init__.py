"""The chatpipe command line: builds each component's settings and wires the packages together.

Nothing imports this package back (DESIGN.md: dependencies point one way).
"""
