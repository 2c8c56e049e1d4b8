"""What a loss-stage call asks and what it means: its options and column groups (``options``), the guide's source
(``guide``), its arguments checked (``checks``) and its groups bound to its columns (``problem``)."""
