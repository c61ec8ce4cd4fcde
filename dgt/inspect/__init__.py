"""Packet inspection: scapy dissectors, pcap summaries, live capture (``dgt inspect`` / ``dgt capture``).

Modules (imported on demand, so ``dgt`` starts fast): ``dissect`` scapy layers; ``pcapio`` pcap -> packet table;
``reassembly`` TCP streams -> frames; ``summary`` per-lane / per-round / timeline summary; ``render`` text;
``plot`` timeline PNG; ``capture`` live capture; ``cli`` the subcommands; ``traffic`` and ``synth`` known DGT
traffic (loopback sockets / straight to pcap) for tests and capture checks. See docs/inspect.md.
"""
