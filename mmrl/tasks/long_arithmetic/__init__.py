"""Arithmetic with large numbers, answered exactly: a text task for agents with a calculator."""
