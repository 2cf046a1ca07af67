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
// parsed, or when a request times out (nbd_mark_nsock_dead: the socket is
// shut down, the device's count of live connections drops, and an
// NBD_CMD_LINK_DEAD notification goes to the family's multicast group).
// A dead socket's requests in flight (sent, unanswered) are not failed
// and not resent when the socket dies, nor when a Reconfigure replaces
// it: only the block layer's request timer brings them back
// (nbd_xmit_timeout). New requests meanwhile wait in nbd_handle_cmd up to
// DeadConnTimeout for a live connection, then fail with EIO (and every
// socket is shut down; the device stays configured until Disconnect).
// Resent requests may already have been applied: the server must
// tolerate replays (stor's writes are idempotent).
//
// What the timer does depends on the request timeout (Timeout):
//
//   - Timeout set (the default, 30 s): a request unanswered for Timeout
//     marks its socket dead, if it is still the socket the request went
//     out on (each slot's cookie counts its Reconfigures), and is resent,
//     on a live socket or, after waiting for one as new requests do, on
//     the next. So a server that dies and comes back stalls the requests
//     it had in flight for Timeout, however quickly it comes back; and a
//     request slower than Timeout on a live socket kills that socket
//     ("Connection timed out, retrying" in the kernel log): a server must
//     then Reconfigure a replacement, which is what stor-ctl nbd attach
//     does for any socket that ends while it runs.
//   - NoTimeout, with one connection: the timer never kills a socket. It
//     fires after the block queue's own timeout (30 s unless
//     SetQueueTimeout set another) and again each time after that; if
//     the request's slot still has the socket the request went out on,
//     dead or alive, the timer is re-armed ("Possible stuck request ...
//     Runtime N seconds" in the kernel log, every time); if a Reconfigure
//     gave the slot a new socket, the request is resent. See below.
//   - NoTimeout, with more than one connection: as with Timeout set, at
//     the block queue's timeout (the kernel's request timeout is not
//     consulted when a device has several connections).
//
// The link-dead notification triggers nothing in the kernel: a listener
// learns that a socket died, which the server learns from its own end,
// and the requests in flight still wait for their timer.
//
// Reconfigure gives each new socket to the first dead slot; a socket given
// when no slot is dead is silently dropped (the call still succeeds) and
// its peer sees end-of-file. A server that sees its end of a freshly
// reconfigured socket close at once should retry later.
//
// # Requeue without a request timeout
//
// A restarted server gets I/O going within a second or two of its
// Reconfigure, without ever turning a slow request into a dead
// connection, with one connection, Timeout NoTimeout and a short
// block-queue timer (SetQueueTimeout, e.g. 500 ms):
//
//  1. The server dies. Its socket dies; requests in flight stay in
//     flight; their timer fires and is re-armed (same socket); new
//     requests wait for a live connection (DeadConnTimeout).
//  2. A new server Reconfigures a new socket: the slot's cookie changes,
//     the waiting new requests go out at once.
//  3. At its next timer each request that was in flight on the old
//     socket sees the cookie changed and is resent on the new one.
//
// The timer is rounded up past the next whole second (blk_add_timer:
// round_jiffies_up), so with a queue timeout under a second a request is
// checked every one to two seconds (1.5 s measured in internal/vmtest,
// where step 3 came 0.56 s after step 2), with one second every two to
// three. A request that is just slow (its socket alive) is re-armed at
// every check, for as long as it takes, and logged each time.
//
// The cost: a request in flight when the server died waits without limit
// (no DeadConnTimeout applies to it) until a Reconfigure or a Disconnect,
// which fails it with EIO; and Connect, and a Reconfigure that sets a
// timeout, reset the queue's timer to the kernel's choice (Timeout, or
// 30 s when it is off), so set it after them. Requests keep the timer they started with: a device that
// had a 30 s timeout when its server died resends its old requests only
// after those 30 s, whatever the new server sets.
//
// Checked in the nbd.ko of Debian 12's 6.1.0-56 (Linux 6.1.192, the VM's
// in internal/vmtest), by disassembly, against nbd.c: nbd_xmit_timeout tests
// NBD_CMD_INFLIGHT without clearing it, and its branch for a request
// timeout of 0 with one connection compares cmd->cookie with the slot's
// nsock->cookie under tx_lock, resending (nbd_requeue_cmd, BLK_EH_DONE)
// when they differ and re-arming (BLK_EH_RESET_TIMER) when they do not;
// nbd_reconnect_socket increments the cookie. A kernel whose
// nbd_xmit_timeout cleared NBD_CMD_INFLIGHT before re-arming (the bug
// "nbd: don't clear 'NBD_CMD_INFLIGHT' flag if request is not completed"
// fixed in 2022) would take a slow request's late reply for a stray one
// and never complete the request: read an older kernel's nbd.c before
// relying on this there. internal/vmtest's TestVMNBDKernel checks the
// resend and a slow request against the VM's kernel.
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
// internal/vmtest's nbd scenario checks the resize in a VM. From 6.9 the
// kernel resizes with the queue frozen: it waits, holding the generic
// netlink lock (the nbd family is not parallel), until every request in
// the device has ended. A request in flight on a dead connection ends
// only at a look of its timer, and with one connection and NoTimeout only
// once a Reconfigure replaced the connection, which cannot come during
// the wait. A Reconfigure applies Size before Sockets. So resize only
// while every connection is live and no request of a replaced one can be
// in flight still (its timer after the replacement); writing the queue's
// timer (SetQueueTimeout) waits the same way from 6.11.
//
// # Concurrency
//
// A Client may be used from several goroutines; requests are serialised
// on its netlink socket.
package kernel
