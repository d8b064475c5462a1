"""Tests of the torch-free pipeline schedules."""
