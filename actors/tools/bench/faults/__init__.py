"""``ringfence bench faults``: the fault matrix. ``runner`` launches and judges one scenario,
``matrix`` lists them (``clients`` and ``storage`` hold theirs), ``cli`` is the command."""
