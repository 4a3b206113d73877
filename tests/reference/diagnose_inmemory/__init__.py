"""The in-memory path of ``creditlab diagnose`` as it was before the streaming reader: every row's token
columns read into flat arrays, the per-token quantities computed on the whole dump, the checks and the
trainers' metrics on those arrays.

Kept unchanged (but for its imports) as the reference that tests/test_diagnose_streaming.py holds the
streaming path to: the same status, value and details of every check, and the same trainer metrics, on
every dump this path could read. It is not part of the package and nothing in ``src`` imports it.
"""
