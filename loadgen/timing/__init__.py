"""The run clock, send times and the timer that keeps them."""
