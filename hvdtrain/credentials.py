"""Passwords in URLs: ``http://alice:s3cr3t@host:5000`` is how a tracking server's user and
password are often given, and every line, file or MLflow parameter that shows the URL would pass
them on (run directories and logs are commonly readable by a whole group on a shared cluster).

The rule, kept in one place: a URL's user-info goes only to the client that authenticates with it
(``hvdtrain.tracking.mlflow`` hands it to MLflow's own credential variables); everything printed, logged
or recorded shows the URL without it, and URLs are compared without it.
"""
from __future__ import annotations

import re
from urllib.parse import unquote, urlsplit

# scheme://, then the user-info: everything up to the last '@' before the host's end. Greedy,
# so a password with an unescaped '@' is removed whole.
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)[^/?#\s]*@")


def without_userinfo(text: str) -> str:
    """``text`` with the user-info of every URL in it removed:
    ``--tracking-uri http://alice:pw@host:5000`` -> ``--tracking-uri http://host:5000``."""
    return _USERINFO.sub(r"\g<scheme>", text)


def split_userinfo(uri: str) -> tuple[str, str | None, str | None]:
    """(the URI without user-info, its user name, its password), unescaped (``p%40ss`` is
    ``p@ss``); None for a part the URI does not give."""
    parts = urlsplit(uri)
    if "@" not in parts.netloc:
        return uri, None, None
    username = unquote(parts.username) if parts.username else None
    password = unquote(parts.password) if parts.password is not None else None
    return without_userinfo(uri), username, password
