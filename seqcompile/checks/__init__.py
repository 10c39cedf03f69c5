"""What a compile checks of itself: the structural check after every stage (`structure.py`) and,
with the `verify` option, the compiled graph against the captured one (`verify.py`)."""
