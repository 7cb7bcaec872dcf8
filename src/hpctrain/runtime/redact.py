"""What looks like a secret, so that nothing hpctrain writes (provenance, lock files, logs,
error messages) holds one.

Three kinds are recognised: a secret-looking option or override (``--hf-token=abc``,
``tracking.api_token=abc``), the user information of a URI (``https://user:pass@host/``) and a
secret-looking query parameter of a URI (``?token=abc``, ``&X-Amz-Signature=abc``).
"""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlsplit

# A name holding one of these words names a secret: HF_TOKEN, --api-key, tracking.api_token.
SECRET_WORDS = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|PASSWD", re.IGNORECASE)
# Query parameters that carry a credential: the words above, plus signatures of pre-signed
# URLs (sig=, X-Amz-Signature=) and the short names services use (pwd=, pass=, auth=).
_SECRET_QUERY = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|PASSWD|PWD|PASS|SIG|AUTH|CREDENTIAL",
                           re.IGNORECASE)
REDACTED = "<redacted>"

# A URI inside free text: scheme://, then anything up to white space or a quote.
_URI = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"<>`]+")
# The user information of an authority: everything up to the last @ before the path.
_USERINFO = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*://)([^/?#]*@)")
_QUERY_PAIR = re.compile(r"([?&;])([^=&;#]*)=([^&;#]*)")


def uri_secrets(uri: str) -> list[str]:
    """What in ``uri`` is a credential, in words ("a user:password", "query parameter 'sig'")."""
    found = []
    try:
        parts = urlsplit(uri)
    except ValueError:  # a malformed authority ([::1): nothing parsed, nothing to name
        return [] if "@" not in uri else ["a user name or password before '@'"]
    if "@" in parts.netloc:
        found.append("a user name or password before '@'")
    found += [f"query parameter {name!r}" for name, _ in
              parse_qsl(parts.query, keep_blank_values=True) if _SECRET_QUERY.search(name)]
    return found


def redact_uri(uri: str) -> str:
    """``uri`` with its user information and secret-looking query values replaced."""
    uri = _USERINFO.sub(lambda m: f"{m[1]}{REDACTED}@", uri)
    return _QUERY_PAIR.sub(
        lambda m: f"{m[1]}{m[2]}={REDACTED}" if _SECRET_QUERY.search(m[2]) else m[0], uri)


def redact_text(text: str) -> str:
    """Free text (a message, a command line) with every URI in it redacted."""
    if "://" not in text:
        return text
    return _URI.sub(lambda m: redact_uri(m[0]), text)


def redact_argv(argv: list[str]) -> list[str]:
    """Hide values of secret-looking options and overrides: ``--hf-token=abc``, ``--api-key abc``,
    ``tracking.api_token=abc``, and the credentials of any URI (``x.uri=https://u:p@host``)."""
    redacted: list[str] = []
    hide_next = False
    for arg in argv:
        name = arg.split("=", 1)[0]
        if hide_next:
            redacted.append(REDACTED)
            hide_next = False
        elif arg.startswith("-") and SECRET_WORDS.search(name):
            if "=" in arg:
                redacted.append(name + "=" + REDACTED)
            else:
                redacted.append(arg)
                hide_next = True
        elif "=" in arg and SECRET_WORDS.search(name):  # a KEY=VALUE override
            redacted.append(name + "=" + REDACTED)
        else:
            redacted.append(redact_text(arg))
    return redacted
