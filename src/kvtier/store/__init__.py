"""Tier layer: verified chunk records held in memory, on disk and in a shared store."""
