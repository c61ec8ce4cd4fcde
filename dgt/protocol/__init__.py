"""Sans-IO round protocol: sender/receiver state machines that take bytes and a clock, do no I/O."""
