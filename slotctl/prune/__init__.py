"""Keeping a slot directory (or an ``s3://`` prefix) under a budget (``slotctl prune``): which files go, in which
order (``plan``: :func:`plan`, from metadata alone), and going (``delete``: :func:`execute`, each file set aside
under a private name, checked again and only then unlinked, ``aside``: the private names and what a killed
prune left put back). The names below are the package's public face: its users import them from here.
"""

from __future__ import annotations

from slotctl.paths import DEFAULT_GRACE
from slotctl.prune.aside import restore_set_aside
from slotctl.prune.delete import delete_checked, delete_object_checked, execute
from slotctl.prune.plan import (DELETE, FAILED, KEEP, OBJECT_TIME, PINNED, SKIPPED, UNDECIDED_REASON, WOULD_DELETE,
                                Entry, Plan, Policy, parse_age, parse_size, plan, time_source)

__all__ = [
    "DEFAULT_GRACE", "DELETE", "FAILED", "KEEP", "OBJECT_TIME", "PINNED", "SKIPPED", "UNDECIDED_REASON",
    "WOULD_DELETE", "Entry", "Plan", "Policy", "delete_checked", "delete_object_checked", "execute", "parse_age",
    "parse_size", "plan", "restore_set_aside", "time_source",
]
