// Package attach serves a stor volume to a kernel NBD device from this
// process: the one implementation behind "stor-ctl nbd attach" and the
// CSI node plugin's NodeStageVolume.
//
// Open attaches the volume in the cluster at a new epoch (engine.Open:
// any earlier holder is fenced), serves it with an nbd.Server over socket
// pairs, and hands the kernel ends to a free /dev/nbdN by generic netlink
// (CONNECT). Run serves until its context ends and then stops cleanly:
// flush the device, DISCONNECT, drain the requests in flight, flush every
// replica, close the engine (and detach the volume in the cluster unless
// Config.KeepAttachment).
//
// Restart recovery. Every served device is recorded in the state dir,
// <dir>/<volume id>.json (device index, kernel backend id "stor:<volume
// id>", connections, node, pid, epoch), written atomically and durably.
// Beside it <dir>/<volume id>.lock is flock'ed by the live server for as
// long as it serves; the kernel drops the lock when the process dies,
// however it dies, so the lock (not the pid) says whether a server lives.
// An Open that finds a record whose device the kernel still has
// connected for the same backend id resumes it: it reopens the engine at
// a new epoch (fencing the dead instance, whose replicas then refuse its
// writes), makes new socket pairs and hands them to the existing device
// (RECONFIGURE). I/O on the device pauses and resumes without errors if
// the new server comes within the kernel's dead-connection timeout.
//
// A kernel connection that ends while serving is replaced the same way
// (RECONFIGURE with one new socket, with backoff). A device the kernel no
// longer takes sockets for was disconnected elsewhere: Run ends with
// ErrGone.
//
// The writeback path. A process serving /dev/nbdN writes back the pages
// the kernel flushes to it: if it needs memory the kernel can free only
// by that writeback, the node deadlocks. PrepareProcess (called by both
// users before they serve the real kernel) sets PR_SET_IO_FLUSHER (Linux
// 5.6+) and oom_score_adj OOMScoreAdj on the process; a refusal is logged
// and serving goes on. deploy/ reserves the node plugin's memory.
//
// Concurrency: an Attachment owns its goroutines (one per connection);
// Run or Abandon ends them and returns after they have stopped. Two
// Opens of one volume against one state dir exclude each other by the
// lock (ErrAlreadyServed).
package attach
