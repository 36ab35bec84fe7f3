"""Stage 1 of a fleet worker: intake. Read requests from the lanes (only as many as the
engine can serve soon), validate and tokenize them (chat templates rendered here), resume
reclaimed ones from what their stream already holds, and follow cancellations."""
