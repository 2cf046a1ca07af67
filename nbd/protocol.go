package nbd

// Wire constants of the NBD protocol (NetworkBlockDevice/nbd doc/proto.md).
// Every integer on the wire is big-endian.

// Handshake magics.
const (
	magicInit        uint64 = 0x4e42444d41474943 // "NBDMAGIC"
	magicOption      uint64 = 0x49484156454f5054 // "IHAVEOPT"
	magicOptionReply uint64 = 0x0003e889045565a9
)

// Transmission magics.
const (
	magicRequest     uint32 = 0x25609513
	magicSimpleReply uint32 = 0x67446698
)

// Handshake flags (server) and client flags.
const (
	flagFixedNewstyle uint16 = 1 << 0
	flagNoZeroes      uint16 = 1 << 1

	clientFlagFixedNewstyle uint32 = 1 << 0
	clientFlagNoZeroes      uint32 = 1 << 1
	clientFlagsKnown               = clientFlagFixedNewstyle | clientFlagNoZeroes
)

// Option types.
const (
	optExportName      uint32 = 1
	optAbort           uint32 = 2
	optList            uint32 = 3
	optStartTLS        uint32 = 5
	optInfo            uint32 = 6
	optGo              uint32 = 7
	optStructuredReply uint32 = 8
	optListMetaContext uint32 = 9
	optSetMetaContext  uint32 = 10
	optExtendedHeaders uint32 = 11
)

// Option reply types.
const (
	repAck    uint32 = 1
	repServer uint32 = 2
	repInfo   uint32 = 3

	repFlagError   uint32 = 1 << 31
	repErrUnsup           = repFlagError | 1
	repErrPolicy          = repFlagError | 2
	repErrInvalid         = repFlagError | 3
	repErrUnknown         = repFlagError | 6
	repErrShutdown        = repFlagError | 7
	repErrTooBig          = repFlagError | 9
)

// Information types of NBD_REP_INFO.
const (
	infoExport      uint16 = 0
	infoName        uint16 = 1
	infoDescription uint16 = 2
	infoBlockSize   uint16 = 3
)

// Transmission flags.
const (
	tflagHasFlags        uint16 = 1 << 0
	tflagReadOnly        uint16 = 1 << 1
	tflagSendFlush       uint16 = 1 << 2
	tflagSendFUA         uint16 = 1 << 3
	tflagSendTrim        uint16 = 1 << 5
	tflagSendWriteZeroes uint16 = 1 << 6
	tflagCanMultiConn    uint16 = 1 << 8
)

// Commands.
const (
	cmdRead        uint16 = 0
	cmdWrite       uint16 = 1
	cmdDisc        uint16 = 2
	cmdFlush       uint16 = 3
	cmdTrim        uint16 = 4
	cmdCache       uint16 = 5
	cmdWriteZeroes uint16 = 6
	cmdBlockStatus uint16 = 7
)

// Command flags.
const (
	cmdFlagFUA    uint16 = 1 << 0
	cmdFlagNoHole uint16 = 1 << 1
)

// Sizes of fixed-length messages.
const (
	requestHeaderLen = 28 // magic 4, flags 2, type 2, handle 8, offset 8, length 4
	replyHeaderLen   = 16 // magic 4, error 4, handle 8
	optionHeaderLen  = 16 // magic 8, option 4, length 4
	optReplyHdrLen   = 20 // magic 8, option 4, type 4, length 4
	maxStringLen     = 4096
)

func cmdName(c uint16) string {
	switch c {
	case cmdRead:
		return "read"
	case cmdWrite:
		return "write"
	case cmdDisc:
		return "disc"
	case cmdFlush:
		return "flush"
	case cmdTrim:
		return "trim"
	case cmdCache:
		return "cache"
	case cmdWriteZeroes:
		return "write-zeroes"
	case cmdBlockStatus:
		return "block-status"
	}
	return "unknown"
}
