"""Secure by default: a server that others can reach must ask for keys.

`tritium serve` and `tritium openai` bind loopback unless told otherwise; binding any other address without
an API key is refused unless `--unsafe-no-auth` says the operator means it (on an open tritonserver anyone who
reaches it can load and unload models through Triton's repository API, which accepts file overrides: with a
python backend, code).
"""

from __future__ import annotations

import ipaddress

UNSAFE_FLAG = "--unsafe-no-auth"


def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address or `localhost` (0.0.0.0, :: and other addresses are not)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def open_bind_refusal(host: str, keyed: bool, unsafe: bool, key_flag: str = "--api-key") -> str | None:
    """Why binding `host` must be refused (None when it may go ahead): a non-loopback address without keys,
    unless `unsafe`."""
    if keyed or unsafe or is_loopback(host):
        return None
    return (f"refusing to serve on {host} without keys: anyone who can reach it could use it (and, on "
            f"tritonserver, load and unload models). Give {key_flag} (or $TRITIUM_API_KEY), bind 127.0.0.1, or "
            f"pass {UNSAFE_FLAG} if the network itself is trusted")
