"""The floor every role stands on: what the coordinator, the workers, the relays and the trainer
client all use, and nothing that belongs to one of them.

    protocol, wire, sockets, session, security   what crosses the wire, and how
    errors, doc_keys, topology                   the types and numbers all roles agree on
    files, logs, memory                          durable files, log set-up, process memory

This package imports no role (coordinator, worker, trainer_client, msd): tests/unit/test_floors.py
checks it.
"""
