"""``kazma init --force`` on a file a person has edited: their file, with what the new answers add merged in.

The file is read and written with ruamel.yaml's round trip, so their comments, order and values stay as they
wrote them. What the answers add: a platform section the file does not have, the operator's identities under
``people:`` that it lacks, the operator among ``approvals.approvers``, and any top-level section it has none
of. Nothing the file already says is changed; what was added is listed for the person to read.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.error import YAMLError


@dataclass
class Merged:
    text: str
    added: list[str] = field(default_factory=list)  # key paths added, as a person reads them


def _yaml() -> YAML:
    yaml = YAML(typ="rt")
    yaml.preserve_quotes = True
    yaml.width = 4096  # never re-wrap a person's long lines
    yaml.indent(mapping=2, sequence=4, offset=2)  # as the template writes lists
    return yaml


def merge_into(old_text: str, new_text: str, *, person: str) -> Merged | None:
    """``old_text`` with what ``new_text`` adds, or None when the old file holds no settings to keep (empty, only
    comments, or YAML that is no mapping: the backup keeps it, and the new file is written whole). Settings that
    are not valid YAML (a typo, a key written twice) raise ruamel's YAMLError."""
    yaml = _yaml()
    try:
        old = yaml.load(old_text)
    except YAMLError:
        if _has_content(old_text):
            raise  # a typo in a person's settings: said, never a reason to write the file anew
        return None
    if not isinstance(old, CommentedMap) or not old:
        return None
    # The template's closing comment belongs to the file, not to the last section merged in (ruamel would carry it
    # along with that section): leave it out of what is added.
    lines = new_text.rstrip().splitlines()
    while lines and (not lines[-1].strip() or lines[-1].lstrip().startswith("#")):
        lines.pop()
    new = yaml.load("\n".join(lines) + "\n")
    assert isinstance(new, CommentedMap)
    merged = Merged(text="")
    for key, value in new.items():
        empty = key in old and (old[key] is None or (isinstance(old[key], CommentedMap) and not old[key]))
        if key not in old or (empty and value):  # `platforms: {}` from a first init: the new section whole
            old[key] = value
            merged.added.append(str(key))
        elif key == "platforms":
            _add_missing(old[key], value, "platforms", merged, depth=1)
        elif key == "people":
            _add_missing(old[key], value, "people", merged, depth=2)
        elif key == "approvals":
            _add_approver(old[key], person, merged)
    out = io.StringIO()
    yaml.dump(old, out)
    merged.text = out.getvalue()
    return merged


def _has_content(text: str) -> bool:
    """Whether ``text`` holds more than blank lines and comments."""
    return any(line.strip() and not line.lstrip().startswith("#") for line in text.splitlines())


def _add_missing(old: Any, new: Any, where: str, merged: Merged, *, depth: int) -> None:
    """Keys of ``new`` that ``old`` lacks, down to ``depth`` levels (a platform; a person's identity)."""
    if not isinstance(old, CommentedMap) or not isinstance(new, CommentedMap):
        return
    for key, value in new.items():
        if key not in old:
            old[key] = value
            merged.added.append(f"{where}.{key}")
        elif depth > 1:
            _add_missing(old[key], value, f"{where}.{key}", merged, depth=depth - 1)


def _add_approver(approvals: Any, person: str, merged: Merged) -> None:
    if not isinstance(approvals, CommentedMap):
        return
    approvers = approvals.get("approvers")
    if approvers is None:
        approvals["approvers"] = CommentedSeq([person])
    elif isinstance(approvers, list) and person not in approvers:
        approvers.append(person)
    else:
        return
    merged.added.append(f"approvals.approvers: {person}")
