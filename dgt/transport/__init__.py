"""DGT transport: endpoint sessions over the reliable and unreliable lanes (public API in dgt.endpoint)."""
