"""Network emulation with pyroute2: namespaces, shaped links, DSCP priority queues."""
