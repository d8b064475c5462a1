"""Tests of foldtrain.profile."""
