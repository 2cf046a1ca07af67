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
//	reply    one message: JSON {"server_id", "generation", "code", "error"}
//	         and, on success, two descriptors (SCM_RIGHTS): the replica's
//	         head data file and its read generation file, both read-only
//
// The replica store decides (replica.Replica.OpenDirect): only a replica
// whose head alone holds the volume (no snapshot layers), not being
// rebuilt, at the engine's epoch; its rules for when the read generation
// advances are in replica/shortcircuit.go.
//
// The client side (Client, View) maps the read generation file and checks
// it before and after every pread: a View whose counter moved is stale
// (ErrStale) and must be dropped; the engine then reads through the server
// (which applies the epoch and every other rule) and may open a new View.
// The engine (replica/engine) uses a View only for a replica its view of
// the volume holds healthy, and only for reads that no write in flight
// overlaps, the same conditions as a read through the server.
//
// Why not more: the Views read one file, so a replica with snapshot layers
// is read through the server (its blocks may live in older layers, which
// only the server's index can tell); a View is opened again after each
// snapshot is merged away.
package localread
