"""Guess the number: a game with feedback over several turns, for language agents."""
