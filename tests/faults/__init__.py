"""The fault suite (invariant 9 under load): faults injected into native engines serving real
requests, every output checked token for token. A test harness, never imported by kvtier."""
