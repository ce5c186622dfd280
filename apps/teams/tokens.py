"""Token format and hashing: ``crc_<prefix>_<secret>`` (personal), ``crw_…`` (worker).

The prefix is stored in clear for lookup and display; the whole token is hashed with
SHA-256. Secrets are 32 random bytes, so a fast hash is safe (no password stretching needed).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

PERSONAL_SCHEME = "crc"
WORKER_SCHEME = "crw"
INVITE_SCHEME = "cri"  # team invitation codes: never accepted as credentials


def generate(scheme: str) -> tuple[str, str, str]:
    """Return (token, prefix, hash)."""
    prefix = secrets.token_hex(6)
    token = f"{scheme}_{prefix}_{secrets.token_urlsafe(32)}"
    return token, prefix, hash_token(token)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def parse_prefix(token: str) -> str | None:
    parts = token.split("_", 2)
    if len(parts) != 3 or parts[0] not in (PERSONAL_SCHEME, WORKER_SCHEME) or not parts[1]:
        return None
    return parts[1]


def parse_invite_prefix(code: str) -> str | None:
    parts = code.split("_", 2)
    if len(parts) != 3 or parts[0] != INVITE_SCHEME or not parts[1] or not parts[2]:
        return None
    return parts[1]


def matches(token: str, stored_hash: str) -> bool:
    return hmac.compare_digest(hash_token(token), stored_hash)
