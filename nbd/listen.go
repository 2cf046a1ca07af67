package nbd

import (
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"strings"
	"syscall"
	"time"
)

// unixPrefix marks a listen address that is a unix socket path.
const unixPrefix = "unix:"

// Listen opens the listener for an address: "unix:/path/to/socket" for a
// unix socket, anything else as a TCP "host:port". A socket file left
// behind by a server that was killed (nothing accepts on it) is replaced;
// a live one is an error.
func Listen(addr string) (net.Listener, error) {
	path, ok := strings.CutPrefix(addr, unixPrefix)
	if !ok {
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			return nil, fmt.Errorf("nbd: listen on %s: %w", addr, err)
		}
		return ln, nil
	}
	if path == "" {
		return nil, fmt.Errorf("nbd: listen on %q: no socket path", addr)
	}
	ln, err := net.Listen("unix", path)
	if err != nil && errors.Is(err, syscall.EADDRINUSE) && staleSocket(path) {
		os.Remove(path)
		ln, err = net.Listen("unix", path)
	}
	if err != nil {
		return nil, fmt.Errorf("nbd: listen on %s: %w", addr, err)
	}
	// NBD has no authentication here: only the socket's owner may connect.
	if err := os.Chmod(path, 0o600); err != nil {
		ln.Close()
		return nil, fmt.Errorf("nbd: listen on %s: socket mode: %w", addr, err)
	}
	return ln, nil
}

// staleSocket reports whether path is a unix socket nobody accepts on.
func staleSocket(path string) bool {
	fi, err := os.Lstat(path)
	if err != nil || fi.Mode().Type() != os.ModeSocket {
		return false
	}
	c, err := net.DialTimeout("unix", path, time.Second)
	if err == nil {
		c.Close()
		return false
	}
	return errors.Is(err, syscall.ECONNREFUSED)
}

// IsLocal reports whether a listen address (as Listen takes it) accepts
// connections from this host only: a unix socket, or TCP on a loopback IP
// or "localhost". An empty host (":10809") listens on every interface.
func IsLocal(addr string) bool {
	if strings.HasPrefix(addr, unixPrefix) {
		return true
	}
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// URI returns the NBD URI (the syntax of libnbd, qemu and fio) of an
// export served on a listener's address: nbd://host:port/name, or
// nbd+unix:///name?socket=/path for a unix socket.
func URI(addr net.Addr, export string) string {
	name := url.PathEscape(export)
	if addr.Network() == "unix" {
		return "nbd+unix:///" + name + "?socket=" + addr.String()
	}
	host, port, err := net.SplitHostPort(addr.String())
	if err != nil {
		return "nbd://" + addr.String() + "/" + name
	}
	return "nbd://" + net.JoinHostPort(host, port) + "/" + name
}
