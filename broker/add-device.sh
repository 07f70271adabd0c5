#!/bin/sh
# Add (or re-key) an MQTT user for one device of a fleet and print its generated password.
#
#   broker/add-device.sh FLEET DEVICE_ID
#
# The username is the device id (the ACL's %u); with `use_username_as_clientid true` (as in
# broker/mosquitto.conf) the broker also makes it the client id, so no device can take over
# another's session. Service users (aggregator, replayer, operator) are added the same way.
# The password file is made root:mosquitto 0640 so that Mosquitto, which drops to the
# `mosquitto` user after start, can read it (run as root; otherwise the group is left alone
# with a warning). Environment:
#   EDGEFCL_PASSWD   password file (default /etc/mosquitto/edgefcl/passwd)
#   EDGEFCL_ACL      ACL file checked for the fleet (default /etc/mosquitto/edgefcl/acl)
#   EDGEFCL_ROOT     topic root (default edgefcl)
set -eu

usage() {
    echo "usage: $0 FLEET DEVICE_ID" >&2
    exit 2
}
[ "$#" -eq 2 ] || usage
FLEET=$1
DEVICE=$2
PASSWD_FILE=${EDGEFCL_PASSWD:-/etc/mosquitto/edgefcl/passwd}
ACL_FILE=${EDGEFCL_ACL:-/etc/mosquitto/edgefcl/acl}
ROOT=${EDGEFCL_ROOT:-edgefcl}

for id in "$FLEET" "$DEVICE"; do
    case "$id" in
        "" | *[/+#:\ ]* | \$*)
            echo "error: '$id' is not a valid id (no '/', '+', '#', ':', spaces or leading '\$')" >&2
            exit 2 ;;
    esac
done
command -v mosquitto_passwd >/dev/null 2>&1 || {
    echo "error: mosquitto_passwd not found; install the mosquitto package" >&2
    exit 1
}

PASSWORD=$(head -c 48 /dev/urandom | base64 | tr -dc 'A-Za-z0-9' | head -c 24)
mkdir -p "$(dirname "$PASSWD_FILE")"
if [ -f "$PASSWD_FILE" ]; then
    mosquitto_passwd -b "$PASSWD_FILE" "$DEVICE" "$PASSWORD"
else
    (umask 027 && mosquitto_passwd -c -b "$PASSWD_FILE" "$DEVICE" "$PASSWORD")
fi
GROUP=${EDGEFCL_BROKER_GROUP:-mosquitto}
chmod 0640 "$PASSWD_FILE"
if [ "$(id -u)" -eq 0 ] && getent group "$GROUP" >/dev/null 2>&1; then
    chown "root:$GROUP" "$PASSWD_FILE"
elif ! chgrp "$GROUP" "$PASSWD_FILE" 2>/dev/null; then
    echo "warning: could not give group '$GROUP' read access to $PASSWD_FILE; run as root" \
        "or: chown root:$GROUP $PASSWD_FILE" >&2
fi

if [ -f "$ACL_FILE" ] && ! grep -q "^[a-z ]*$ROOT/$FLEET/" "$ACL_FILE"; then
    echo "warning: $ACL_FILE has no rules for $ROOT/$FLEET; render broker/acl.template for it" >&2
fi

echo "device:   $DEVICE (fleet $FLEET)"
echo "username: $DEVICE"
echo "password: $PASSWORD"
echo "reload the broker to apply: kill -HUP <mosquitto pid>  (or: systemctl reload mosquitto)" >&2
