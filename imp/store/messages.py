"""The Responses store's messages: defined in the catalogue (`imp.messages`), re-exported
here for the store and its client, with the groupings they use."""

from __future__ import annotations

from imp.messages import (  # noqa: F401 - re-exported
    ChainLink, StoreDelete, StoreGet, StoreGetChain, StoreItem, StoreListInputItems, StorePut, StoreReply,
    StoreStatus, StoreSweep,
)
from imp.messages.store import failed  # noqa: F401 - re-exported (the client has it from there too)

StoreRequest = StorePut | StoreGet | StoreGetChain | StoreDelete | StoreListInputItems | StoreSweep
STORE_MESSAGES = (StorePut, StoreGet, StoreGetChain, StoreDelete, StoreListInputItems, StoreSweep, StoreReply)
WRITES = (StorePut, StoreDelete, StoreSweep)  # run inside the writer's transaction
