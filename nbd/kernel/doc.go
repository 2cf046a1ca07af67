// Package kernel attaches Linux /dev/nbdN devices to an NBD server through
// the kernel's generic-netlink "nbd" family (linux/nbd-netlink.h), the
// interface that, unlike the NBD_SET_SOCK/NBD_DO_IT ioctls, can hand a
// connected device new sockets. DESIGN.md, "NBD: own server, kernel attach
// by netlink".
//
// # Commands
//
//   - Connect (NBD_CMD_CONNECT): size, block size, request timeout,
//     dead-connection timeout, the server's transmission flags, client
//     flags, a backend identifier, and one or more connected stream sockets
//     (unix or TCP). The kernel picks a free device when Index is AnyIndex
//     and answers with the index. It returns at once: the kernel's receive
//     workers serve the device from then on, and the sockets' file
//     descriptors may be closed by the caller (the kernel holds its own
//     references).
//   - Reconfigure (NBD_CMD_RECONFIGURE): new sockets for a connected
//     device, a new size, new timeouts. The device's backend identifier
//     must be given and match, so a device can never be handed to the
//     wrong volume.
//   - Disconnect (NBD_CMD_DISCONNECT): the kernel sends NBD_CMD_DISC on
//     every socket, shuts them down and fails whatever I/O is still queued
//     with EIO (flush and quiesce the device before).
//   - Status (NBD_CMD_STATUS): which devices exist and which are connected.
//
// The netlink replies carry an errno only; the kernel logs the reason with
// pr_err/dev_err, so errors here point at the kernel log.
//
// # What the kernel does (drivers/block/nbd.c, Debian 12's 6.1)
//
// The kernel speaks only the transmission phase on the sockets it is
// given: no handshake, simple replies only, commands READ, WRITE (with
// NBD_CMD_FLAG_FUA when the server sets SEND_FUA), FLUSH, TRIM, DISC. 6.1
// does not send WRITE_ZEROES (added in 6.4), so SEND_WRITE_ZEROES is
// ignored there. More than one socket needs CAN_MULTI_CONN.
//
// Sockets die when the server closes its end, when a reply cannot be
// parsed, or when a request times out. A dead socket's requests are not
// failed: the kernel resends each one when its request timer (Timeout)
// expires, on a live socket if there is one, otherwise after waiting up to
// DeadConnTimeout for a Reconfigure to bring one. New requests wait the
// same way. So a server process can die and a new one take over: it opens
// new socket pairs and Reconfigures; I/O pauses and resumes. The pause is
// bounded by Timeout: requests that were in flight on the dead sockets are
// resent only when their timer fires (the kernel does not resend them on
// reconnect), so with Timeout 30 s a crash can stall the oldest request up
// to 30 s, however quickly the server comes back. The resent requests may
// already have been applied: the server must tolerate replays (stor's
// writes are idempotent). If nothing reconnects within DeadConnTimeout,
// the queued requests fail with EIO and the device's sockets are shut
// down; the device stays configured until Disconnect.
//
// With Timeout set (or more than one socket), a request that takes longer
// than Timeout on a live socket also kills that socket ("Connection timed
// out, retrying" in the kernel log) and is resent: a server must then
// Reconfigure a replacement socket, which is what stor-ctl nbd attach does
// for any socket that ends while it runs.
//
// Reconfigure gives each new socket to the first dead slot; a socket given
// when no slot is dead is silently dropped (the call still succeeds) and
// its peer sees end-of-file. A server that sees its end of a freshly
// reconfigured socket close at once should retry later.
//
// # Several connections on Linux 6.1
//
// The kernel reads each socket's replies in a work item (recv_work) that
// runs for the life of the connection, on the device's WQ_MEM_RECLAIM
// workqueue (nbdN-recv). When the workqueue cannot get a worker thread
// within 10 ms (early after boot on a slow machine, or under memory
// pressure) its rescuer thread takes the pending items and runs them one
// after the other; 6.1's rescuer does not let go of the others while one
// runs, and recv_work never returns. The second connection's replies then
// sit unread in its socket until its requests time out (Timeout, 30 s by
// default); the kernel then declares that socket dead ("Connection timed
// out, retrying") and resends on the first, and a server that replaces
// dead sockets (stor-ctl nbd attach does) gets going again. No I/O fails,
// but the device stalls for Timeout. Seen in internal/vmtest about one
// boot in four on the first connect, with two connections: /proc showed a
// single nbd0-recv task, running recv_work from rescuer_thread, while the
// server had written the reply (4112 bytes) 30 s before. Newer kernels
// process rescued items one by one ("workqueue: Process rescuer work
// items one-by-one using a positional marker"). One connection is not
// affected; stor-ctl nbd attach defaults to one.
//
// # Network namespaces
//
// A generic-netlink family is visible only in the network namespaces it
// declares itself fit for. nbd's was not before Linux 6.3 (a February 2023
// patch made it netns-aware): in any other namespace than the initial one
// the kernel answers the family lookup with ENOENT, exactly as if the
// module were not loaded. Dial tells the two apart by /sys/module/nbd
// (the same in every namespace): module there, family not found is
// ErrNetNamespace, which names the kernel's release and says to run in the
// host's network namespace (a Kubernetes pod: hostNetwork). That covers
// the kernels of Debian 12 (6.1), Ubuntu 22.04 (5.15), RHEL 9 (5.14) and
// Amazon Linux 2023 (6.1), unless the distribution backported the patch
// (then Dial simply succeeds). internal/vmtest's TestVMNodePluginNetns shows it on the
// VM's kernel: under unshare -n, Debian's 6.1.0 answers ENOENT while the
// module is loaded and serves the initial namespace.
//
// # Resizing
//
// Reconfigure with Size resizes a connected device in 6.1: the netlink
// handler sets the new capacity (set_capacity_and_notify), which emits a
// change uevent; a mounted filesystem can then be grown online (ext4:
// resize2fs). Shrinking works the same way and is the caller's risk. The
// ioctl path (NBD_SET_SIZE) is no alternative: the kernel refuses every
// ioctl but NBD_DISCONNECT and NBD_CLEAR_SOCK on a device configured by
// netlink ("Cannot use ioctl interface on a netlink controlled device").
// internal/vmtest's nbd scenario checks the resize in a VM.
//
// # Concurrency
//
// A Client may be used from several goroutines; requests are serialised
// on its netlink socket.
package kernel
