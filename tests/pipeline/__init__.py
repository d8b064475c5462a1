"""Tests of foldtrain.pipeline."""
