import difflib


def closest(name, choices):
    """A ' (did you mean X?)' hint for error messages, or ''."""
    match = difflib.get_close_matches(str(name), [str(c) for c in choices], n=1)
    return f" (did you mean {match[0]!r}?)" if match else ""
