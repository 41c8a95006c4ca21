"""Adapters for the implementations the suite knows by name."""
