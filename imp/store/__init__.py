"""The Responses store: stored `/v1/responses` objects and their input items, on SQLite.

    config.py    StoreConfig (path, limits), frozen and validated once
    messages.py  the store's messages (requests, StoreReply)
    schema.py    tables and migrations (schema_version)
    sqlite.py    open_store(config) at boot -> StoreDB, or StoreOpenError naming the file
    ops.py       put / get / chain / delete / input_items / evict as plain functions
    worker.py    the writer thread: the connection's one user, group commit
    actor.py     StoreActor ("store"): bus <-> writer thread, counters for metrics
    client.py    StoreClient: what the HTTP side awaits
"""
