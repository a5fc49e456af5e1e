"""Message ids ``PREFIX_yyyyMMddHHmmssSSS_NODE_SEQ``: generate, parse, and lease node names."""

from __future__ import annotations

from idemq.ids.format import MessageIdParts, parse_message_id
from idemq.ids.generator import MessageIdGenerator, generate_ids
from idemq.ids.node_lease import NodeLease, lease_node

__all__ = [
    "MessageIdGenerator",
    "MessageIdParts",
    "NodeLease",
    "generate_ids",
    "lease_node",
    "parse_message_id",
]
