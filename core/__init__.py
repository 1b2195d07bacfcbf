"""The floor the proxy and the trainer both stand on: settings, the database, the tables, the
binary formats, the transition record and the adapter (policy) lifecycle. Imports nothing above it.
"""
