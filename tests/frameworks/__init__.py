

import contextlib
from typing import Any, Iterator


@contextlib.contextmanager
def unpatched(*classes: Any) -> Iterator[None]:
    """The trainer's own methods on ``classes`` while inside (every method rtrace wrapped,
    found by its ``__rtrace_wrapped__`` mark, put back to ``__wrapped__``), rtrace's after:
    the baseline of "outputs unchanged" is the trainer without rtrace, not rtrace switched off."""
    saved = []
    for cls in classes:
        for name, attr in list(vars(cls).items()):
            if getattr(attr, "__rtrace_wrapped__", False):
                saved.append((cls, name, attr))
                setattr(cls, name, attr.__wrapped__)
    assert saved, "nothing of rtrace's was installed on these classes"
    try:
        yield
    finally:
        for cls, name, attr in saved:
            setattr(cls, name, attr)
