//! Review 25b: the parked streams of frees that wait for a capture or a graph (`ParkedStream`,
//! `FreeStreams`), and what else holds a stream while it waits.
