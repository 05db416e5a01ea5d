"""fsspec storage options from an explicit environment: the job's.

A pull made for a job (by the daemon, or a helper acting for it) must reach
the store with the credentials the job's own uploads use, which live in the
job's environment (its ``env:``, the HOME of its user), not in the daemon's.
botocore reads only its own process's environment, so the standard AWS
variables of the given mapping are turned into s3fs arguments here:

    AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN   key, secret, token
    AWS_ENDPOINT_URL_S3, else AWS_ENDPOINT_URL                    endpoint_url
    AWS_REGION, else AWS_DEFAULT_REGION                           region_name
    AWS_PROFILE                                                    the profile
    AWS_SHARED_CREDENTIALS_FILE, AWS_CONFIG_FILE, else HOME/.aws/  the files read

What the mapping does not set falls back to botocore's own chain in this
process (an instance role, for one). ``env=None``: no options at all, the
process's own environment as is (the Snapshotter inside the job).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

__all__ = ["storage_options"]

_S3 = ("s3", "s3a")


def _protocol(url: str) -> str:
    return url.split("://", 1)[0].lower() if "://" in url else "file"


def storage_options(url: str, env: Mapping[str, str] | None) -> dict[str, Any]:
    """The keyword arguments of ``url``'s filesystem that make it use ``env``'s
    credentials and endpoint; {} for a URL that has none (file://) or env None."""
    if env is None or _protocol(url) not in _S3:
        return {}
    out: dict[str, Any] = {}
    key, secret = env.get("AWS_ACCESS_KEY_ID"), env.get("AWS_SECRET_ACCESS_KEY")
    if key and secret:
        out["key"], out["secret"] = key, secret
        if env.get("AWS_SESSION_TOKEN"):
            out["token"] = env["AWS_SESSION_TOKEN"]
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    if endpoint:
        out["endpoint_url"] = endpoint
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
    if region:
        out["client_kwargs"] = {"region_name": region}
    home = env.get("HOME")
    files = {
        "credentials_file": env.get("AWS_SHARED_CREDENTIALS_FILE")
        or (os.path.join(home, ".aws", "credentials") if home else None),
        "config_file": env.get("AWS_CONFIG_FILE")
        or (os.path.join(home, ".aws", "config") if home else None),
        "profile": env.get("AWS_PROFILE"),
    }
    if any(files.values()):
        import aiobotocore.session  # type: ignore[import-untyped]  # s3fs's, no stubs

        session = aiobotocore.session.AioSession()
        for name, value in files.items():
            if value:
                session.set_config_variable(name, value)
        out["session"] = session
    # Not fsspec's cached instance: its key would hold the session, and a daemon
    # that pulls for many jobs must not keep a client per pull.
    out["skip_instance_cache"] = True
    return out
