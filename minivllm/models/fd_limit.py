"""Keep the process's open-file limit when mlx-lm is imported.

`mlx_lm.utils` sets RLIMIT_NOFILE to (2048, 4096) at import, whatever the shell allowed: a server then runs
out of descriptors at ~2,000 connections, and the hard limit, once lowered, cannot be raised again by an
unprivileged process. So mlx-lm is imported here with setrlimit of that one resource suppressed, and the
soft limit is then raised to the hard one (what a server wants; the shell's hard limit stays the bound).
"""

import resource
import sys

SOFT_CAP = 1 << 20  # a hard limit of RLIM_INFINITY (macOS): a soft limit the kernel accepts


def import_mlx_lm_keeping_the_fd_limit() -> None:
    if "mlx_lm.utils" in sys.modules:
        return
    real = resource.setrlimit

    def setrlimit(which, limits):
        if which != resource.RLIMIT_NOFILE:
            real(which, limits)

    resource.setrlimit = setrlimit
    try:
        import mlx_lm.utils  # noqa: F401
    finally:
        resource.setrlimit = real
    raise_soft_limit()


def raise_soft_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = SOFT_CAP if hard == resource.RLIM_INFINITY else hard
    for wanted in (target, 10240):  # macOS refuses more than kern.maxfilesperproc: its usual value then
        if soft >= wanted:
            return
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            return
        except (ValueError, OSError):
            continue
