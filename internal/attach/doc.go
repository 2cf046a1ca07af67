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
// connected for the same backend id resumes it, if the volume is still at
// the record's epoch and not attached to another node (checkResumable): it
// reopens the engine at a new epoch (fencing the dead instance, whose
// replicas then refuse its writes), makes new socket pairs and hands them
// to the existing device (RECONFIGURE). I/O on the device pauses and
// resumes without errors if the new server comes within the kernel's
// dead-connection timeout. A device left at an epoch the volume has left
// (attached again since, elsewhere or after a detach) is disconnected
// instead: the kernel would resend the requests still in it over what was
// written since. So is the device of an engine fenced while it runs
// (Run), and Release disconnects what a stop left, for a caller that gives
// the volume up on this node.
//
// # Restart without a stall
//
// The kernel resends a request that was in flight when its server died
// only when the request's timer fires (nbd/kernel's documentation). So a
// device with one connection (the default) runs without a kernel request
// timeout (Config.IOTimeout 0: kernel.NoTimeout) and with a block-queue
// timer of RequeueInterval, which makes the kernel look at each request
// that runs that long, and again every one to two seconds (measured in
// internal/vmtest: 1.5 s): it keeps a request whose connection is still
// the one it went out on, however slow, and resends one whose connection
// a RECONFIGURE replaced. The steps of a restart, and what a fault at
// each one does:
//
//  1. The process dies (SIGKILL, a crash, an upgrade). The kernel sees its
//     socket close and marks it dead. Requests in flight on it stay in
//     flight and are kept at each timer; new ones wait for a live
//     connection up to DeadConnTimeout and then fail with EIO. If no
//     process comes back, that is what happens: new I/O fails after
//     DeadConnTimeout; the requests that were in flight wait until a
//     RECONFIGURE or a DISCONNECT ("stor-ctl nbd detach", which fails
//     them with EIO).
//  2. A new process takes the lock and finds the record; the kernel still
//     has the device connected for the same backend id, and the volume is
//     at the record's epoch: resume. The record is marked resuming, and
//     takes the new epoch as soon as the attach of step 3 commits. A death
//     here is step 1 again.
//  3. engine.Open at a new epoch fences the dead process's engine (its
//     replicas refuse its writes) and reconciles the regions the kill
//     left dirty. A death here is step 1 again; the next Open opens at a
//     newer epoch still.
//  4. RECONFIGURE hands the kernel the new sockets, with DeadConnTimeout
//     and the volume's size. Waiting new requests go out at once, and
//     start with the queue's timer of that moment, which they keep. A
//     device an attach like this one left (one connection, no request
//     timeout, the timer at RequeueInterval, which only this package
//     sets), resumed without --io-timeout, gets no timeout attribute, so
//     they start with RequeueInterval: a timeout attribute resets the
//     timer (to the kernel's 30 s when there is no request timeout). Any
//     other device gets this attach's request timeout, and the requests
//     it wakes keep the timer that gives. A volume that grew while no
//     process served it keeps the device's old size here: Linux from 6.9
//     resizes only once every request in the device ended (nbd_set_size
//     freezes the queue), and those in flight on the dead connection end
//     only once it was replaced; Run grows the device later (followSize:
//     once every connection is live and the requests of the replaced one
//     were resent, their timer and two seconds after the handover). A
//     death right after is step 1 with the new socket: the requests
//     resent to it wait again, as new requests do.
//  5. With one connection and no request timeout, the block-queue timer
//     is set to RequeueInterval again if step 4 reset it. Only after the
//     sockets: Linux from 6.11 (until a later release dropped it) freezes
//     the queue for the write too, which then waits until the requests
//     that were in flight at the death were resent (at their own timer,
//     up to 30 s for a device an older stor-ctl connected). At the
//     timer's next check after step 4, within two seconds, each request
//     that was in flight at the death finds its connection replaced and
//     is resent; the pause is the time to step 4 and a second or so more
//     (0.5–0.6 s in internal/vmtest). Requests keep the timer they started
//     with: the first restart after an upgrade from a stor-ctl that set a
//     30 s request timeout still waits those 30 s. A resent write may
//     already have been applied by the dead process: stor's writes are
//     idempotent.
//  6. The record is rewritten (pid, epoch). A death before it leaves the
//     old record, which names the same device: the next process resumes
//     it just the same.
//
// Several connections: Linux resends on any timer firing of a device with
// more than one connection, after dropping the connection (even a live
// one), so they keep the kernel's 30 s timer, and a restart waits for it.
// Config.IOTimeout set: the kernel's own timeout, with the same cost. The
// nbd family's link-dead notifications (NBD_CMD_LINK_DEAD) are not used:
// they tell that a socket died, which a live process learns from its own
// end and a restarted one from the record, and they make the kernel
// resend nothing. A clean stop gives the device's queue back the kernel's
// 30 s timer.
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
