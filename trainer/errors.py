"""TrainError: bad input, a sync timeout or a lost device, raised before anything is applied."""


class TrainError(RuntimeError):
    """Training could not proceed; the message says what was wrong. No weight was changed."""
