"""Process plumbing shared by every role: spawning child interpreters, the connection and hand-shake
between a parent and its children, and what a child does to never outlive its parent."""
