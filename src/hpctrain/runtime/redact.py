"""What looks like a secret, so that nothing hpctrain writes (provenance, lock files) holds one."""

from __future__ import annotations

import re

# A name holding one of these words names a secret: HF_TOKEN, --api-key, tracking.api_token.
SECRET_WORDS = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|PASSWD", re.IGNORECASE)


def redact_argv(argv: list[str]) -> list[str]:
    """Hide values of secret-looking options and overrides: ``--hf-token=abc``, ``--api-key abc``,
    ``tracking.api_token=abc``."""
    redacted: list[str] = []
    hide_next = False
    for arg in argv:
        name = arg.split("=", 1)[0]
        if hide_next:
            redacted.append("<redacted>")
            hide_next = False
        elif arg.startswith("-") and SECRET_WORDS.search(name):
            if "=" in arg:
                redacted.append(name + "=<redacted>")
            else:
                redacted.append(arg)
                hide_next = True
        elif "=" in arg and SECRET_WORDS.search(name):  # a KEY=VALUE override
            redacted.append(name + "=<redacted>")
        else:
            redacted.append(arg)
    return redacted
