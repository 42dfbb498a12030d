"""Output text for output_mode "text" and "derender": incremental detokenizing, stop strings, token strings."""
