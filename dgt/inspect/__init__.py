"""Packet inspection: scapy dissectors, pcap summaries, live capture."""
