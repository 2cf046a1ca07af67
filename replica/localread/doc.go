// Package localread is stor's short-circuit local read (DESIGN.md, "Data
// path", point 6), after HDFS's: a volume engine on the same host as a
// server that holds one of its replicas reads that replica's data with
// pread on descriptors the server passed it, instead of one request and
// reply per read over the replica data protocol. Writes keep the protocol.
//
// The server side (Server) listens on a unix socket, mode 0600, and accepts
// only peers running as root or as the server's own user (SO_PEERCRED):
// whoever can connect can read the store's files anyway. A connection
// carries one request and one reply:
//
//	request  one JSON line: {"replica", "volume", "epoch"}; an empty
//	         replica asks only for the server id
//	reply    one JSON line {"version" (1), "server_id", "generation",
//	         "runs", "code", "error"} sent with, on success, the descriptors (SCM_RIGHTS)
//	         of the replica's read generation file and of each layer's
//	         data file, oldest first, all read-only; then each layer's
//	         index, "runs"[i] runs of 16 bytes (start and end block,
//	         little-endian)
//
// The replica store decides (replica.Replica.OpenDirect): a replica not
// being rebuilt, at the engine's epoch, with at most
// replica.MaxDirectLayers layers; its rules for when the read generation
// advances are in replica/shortcircuit.go. A stor-server also requires
// (Server.RequireHandles) that the engine hold the replica open at that
// epoch through the server's own process (wire.Server.HasHandle): an
// engine whose connection died with an earlier process of the server,
// which may have lost acknowledged writes in a crash, must not open a
// view of the restarted one.
//
// The client side (Client, View) reads each block as the server would:
// from the head if the head's index held it or the engine told the View it
// writes it (View.Track: the engine is the volume's only writer, and opens
// a View of several layers while none of its writes is in flight), else
// from the topmost older layer whose index holds it, else from the head,
// where the server keeps such a block a hole (replica/shortcircuit.go). It maps the read generation file and checks it after every
// pread: a View whose counter moved is stale (ErrStale) and must be
// dropped; the engine then reads through the server (which applies the
// epoch and every other rule) and may open a new View. The engine
// (replica/engine) uses a View only for a replica its view of the volume
// holds healthy, and only for reads that no write in flight overlaps, the
// same conditions as a read through the server. The connection that
// carried the descriptors stays open while the View lives; the server's
// end closing makes the View stale too: the process died, or the replica
// could not advance its read generation when it failed or closed (the
// server closes the connections of its views then).
package localread
