"""The record wing: everything that makes a call durable (the writer, the journal, all SQL of the
proxy, credit, rewards, traces, housekeeping). The relay hands it records through its door,
intake.py; the routes above read and write through the rest. docs/architecture.md draws both.
"""
