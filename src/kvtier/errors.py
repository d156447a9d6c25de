"""Exceptions shared by every layer; each names the offending value and the fix."""


class KVTierError(Exception):
    """Base class for kvtier errors."""


class ConfigError(KVTierError, ValueError):
    """A configuration value is invalid; the message names the key, the value and the fix."""


class TopologyError(KVTierError, ValueError):
    """Parallel sizes or a lookup scope contradict each other or the world."""


class LayoutError(KVTierError, ValueError):
    """KV geometry cannot be derived or does not fit the chunking."""


class StartupError(KVTierError, RuntimeError):
    """Offload was requested but a required piece failed to build; startup stops."""
